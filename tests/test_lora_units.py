"""LoRA's settings, names and events, without a model."""

from __future__ import annotations

import pytest

from app.config import EngineConfig
from app.engine.errors import AdapterNotFound, InvalidParameter
from app.engine.kv_blocks import BlockManager
from app.engine.kv_events import KVEventLog
from app.engine.loras import LoRARegistry, lora_id, parse_module


def test_lora_modules_take_both_of_vllms_forms():
    assert parse_module("sql=/a/sql") == ("sql", "/a/sql", None)
    assert parse_module('{"name": "chat", "path": "/a/chat", "base_model_name": "b"}') == \
        ("chat", "/a/chat", "b")
    for bad in ("noequals", "=path", "name=", '{"name": "x"}', "{not json"):
        with pytest.raises(ValueError):
            parse_module(bad)


def test_settings_are_checked_at_start():
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig.from_kwargs(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="needs enable_lora"):
        EngineConfig.from_kwargs(lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineConfig.from_kwargs(enable_lora=True, max_lora_rank=0)
    lora = EngineConfig.from_kwargs(enable_lora=True, lora_modules="a=/x").lora
    assert lora.lora_modules == ("a=/x",) and lora.max_loras == 1 and lora.max_lora_rank == 16


def test_runtime_loading_is_confined_to_the_allowed_dirs(tmp_path):
    (tmp_path / "ok" / "a").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "ok" / "escape").symlink_to(tmp_path / "elsewhere")
    config = EngineConfig.from_kwargs(enable_lora=True,
                                      lora_modules=[f"a={tmp_path / 'ok' / 'a'}"]).lora
    registry = LoRARegistry(config, ["base"])
    assert registry.allowed_dirs == [str(tmp_path / "ok")]
    assert registry.check_path(str(tmp_path / "ok" / "b")) == str(tmp_path / "ok" / "b")
    for outside in (tmp_path / "elsewhere", tmp_path / "ok" / ".." / "elsewhere",
                    tmp_path / "ok" / "escape", tmp_path / "okay"):
        with pytest.raises(InvalidParameter, match="outside"):
            registry.check_path(str(outside))
    none = LoRARegistry(EngineConfig.from_kwargs(enable_lora=True).lora, ["base"])
    with pytest.raises(InvalidParameter, match="--lora-allowed-dirs"):
        none.check_path(str(tmp_path / "ok" / "a"))


def test_names_and_ids():
    registry = LoRARegistry(EngineConfig.from_kwargs(enable_lora=True,
                                                     lora_allowed_dirs=["/"]).lora, ["base"])
    first = registry.begin("a", "/x", startup=True)
    with pytest.raises(InvalidParameter, match="already"):
        registry.begin("a", "/y")  # pending counts as taken
    with pytest.raises(InvalidParameter, match="base model"):
        registry.begin("base", "/y")
    assert lora_id(registry, None) == 0
    with pytest.raises(AdapterNotFound, match="does not exist"):
        lora_id(registry, "a")  # not published until read
    with pytest.raises(AdapterNotFound):
        lora_id(None, "a")
    assert registry.begin("b", "/y").lora_id != first.lora_id


def test_kv_events_carry_the_adapter():
    blocks = BlockManager(8, 4)
    blocks.events = KVEventLog(4)
    tokens = list(range(8))
    for rid, adapter in (("base", 0), ("lora", 7)):
        names = blocks.block_names(lambda a, b: tokens[a:b], [], 8,
                                   None if not adapter else (None, "lora", adapter))
        blocks.allocate(rid, 8)
        blocks.register(rid, names, 0, 2, lambda a, b: tokens[a:b], adapter)
    stored = [e for e in blocks.events.take() if e["type"] == "BlockStored"]
    assert [e["lora_id"] for e in stored] == [None, 7]
    assert set(stored[0]["block_hashes"]).isdisjoint(stored[1]["block_hashes"])
    blocks.check()
