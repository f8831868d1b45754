"""The LoRA adapters the engine serves, by name (event loop side; `gpu/lora.py` holds
their tensors on the model thread).

A request names an adapter (the OpenAI `model` field, `SamplingParams.lora_name`); the
core gives the request the adapter's id, which travels in the batch, keys the prefix
cache (two adapters never share KV) and tags KV events. Ids are never reused: an
adapter unloaded and loaded again under the same name is a new id, so nothing cached
under the old weights can be taken for the new.

Loading is two halves around the model thread: `begin` checks the name and the path
(on the event loop, at once) and reserves both; the model thread reads and checks the
files (`models/lora.py`: rank, shapes against the base, format); `finish` publishes
the adapter, or releases the reservation and raises the 400. Paths are resolved
(symlinks, `..`) before they are checked against the allowed directories: the
`--lora-allowed-dirs`, by default the directories holding the `--lora-modules`
adapters; with neither, only the start-up adapters are served.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from app.config import LoRAConfig
from app.engine.errors import AdapterInUse, AdapterNotFound, InvalidParameter


@dataclass(frozen=True)
class LoRAAdapter:
    lora_id: int
    name: str
    path: str
    base_model_name: str | None = None
    rank: int = 0


def parse_module(entry: str | dict) -> tuple[str, str, str | None]:
    """(name, path, base model) from `name=path` or vLLM's JSON object."""
    if isinstance(entry, str) and entry.lstrip().startswith("{"):
        try:
            entry = json.loads(entry)
        except ValueError as e:
            raise ValueError(f"--lora-modules entry {entry!r} is not valid JSON: {e}") from e
    if isinstance(entry, dict):
        if not isinstance(entry.get("name"), str) or not isinstance(entry.get("path"), str):
            raise ValueError(f"--lora-modules entry {entry!r} needs \"name\" and \"path\"")
        return entry["name"], entry["path"], entry.get("base_model_name")
    name, sep, path = str(entry).partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules entry {entry!r} is neither name=path nor JSON")
    return name, path, None


class LoRARegistry:
    def __init__(self, config: LoRAConfig, base_names: list[str]):
        self.config = config
        self.base_names = base_names  # names an adapter may not take
        self.adapters: dict[str, LoRAAdapter] = {}
        self.by_id: dict[int, LoRAAdapter] = {}
        self._pending: set[str] = set()
        self._next_id = 1
        self.startup = [parse_module(e) for e in config.lora_modules or ()]
        dirs = config.lora_allowed_dirs
        if dirs is None:
            dirs = [str(Path(path).parent) for _, path, _ in self.startup]
        self.allowed_dirs = [os.path.realpath(d) for d in dirs]

    def get(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise AdapterNotFound(f"The model `{name}` does not exist.")
        return adapter

    def names(self) -> list[str]:
        return list(self.adapters)

    def check_path(self, path: str) -> str:
        """The resolved path, if it lies inside an allowed directory (400 otherwise)."""
        if not isinstance(path, str) or not path:
            raise InvalidParameter("lora_path", "lora_path must be a non-empty string")
        if "\x00" in path:  # no file has such a name: the OS would refuse it outright
            raise InvalidParameter("lora_path", "lora_path must not contain a NUL byte")
        real = os.path.realpath(path)
        if not self.allowed_dirs:
            raise InvalidParameter("lora_path", "loading adapters at run time is off: start "
                                   "the server with --lora-allowed-dirs (or --lora-modules)")
        if not any(os.path.commonpath([real, d]) == d for d in self.allowed_dirs):
            raise InvalidParameter("lora_path", f"{path!r} is outside the directories "
                                   "adapters may be loaded from (--lora-allowed-dirs)")
        return real

    def begin(self, name: str, path: str, startup: bool = False) -> LoRAAdapter:
        """Reserve `name` and an id for an adapter about to be read (400 if it cannot)."""
        if not isinstance(name, str) or not name.strip():
            raise InvalidParameter("lora_name", "lora_name must be a non-empty string")
        if name in self.adapters or name in self._pending:
            raise InvalidParameter("lora_name", f"The lora adapter '{name}' has already "
                                   "been loaded.")
        if name in self.base_names:
            raise InvalidParameter("lora_name", f"{name!r} is the base model's name")
        real = os.path.realpath(path) if startup else self.check_path(path)
        self._pending.add(name)
        adapter = LoRAAdapter(self._next_id, name, real)
        self._next_id += 1
        return adapter

    def finish(self, adapter: LoRAAdapter, read: Future, base: str | None = None
               ) -> LoRAAdapter:
        """Publish the adapter once the model thread has read it (`read`: done, its
        result the adapter's rank); a 400 naming what was wrong otherwise."""
        self._pending.discard(adapter.name)
        error = read.exception()
        if error is not None:
            if isinstance(error, ValueError):  # models.lora.AdapterError, bad shapes
                raise InvalidParameter("lora_path", f"cannot load LoRA adapter "
                                       f"{adapter.name!r}: {error}") from error
            raise error
        done = LoRAAdapter(adapter.lora_id, adapter.name, adapter.path, base, read.result())
        self.adapters[done.name] = self.by_id[done.lora_id] = done
        return done

    def remove(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
        del self.by_id[adapter.lora_id]
        return adapter


def start_registry(config: LoRAConfig, worker, base_names: list[str]
                   ) -> LoRARegistry | None:
    """The registry with the `--lora-modules` adapters loaded (a bad one fails the start);
    None without `--enable-lora`."""
    if not config.enable_lora:
        return None
    registry = LoRARegistry(config, base_names)
    for name, path, base in registry.startup:
        adapter = registry.begin(name, path, startup=True)
        read = worker.call(lambda r, a=adapter: r.loras.add(a.lora_id, a.path))
        read.exception()  # wait
        registry.finish(adapter, read, base)
    return registry


def lora_id(registry: LoRARegistry | None, name: str | None) -> int:
    """The id a request for `name` carries (0: the base model); 404 if none is served."""
    if name is None:
        return 0
    if registry is None:
        raise AdapterNotFound(f"The model `{name}` does not exist.")
    return registry.get(name).lora_id


def adapters_in_use(registry: LoRARegistry, running, waiting) -> tuple[str, str]:
    """The adapters of the running and of the waiting requests, as vLLM's
    `lora_requests_info` labels them (names, comma-separated, sorted)."""
    def names(requests) -> str:
        ids = {r.lora_id for r in requests} - {0}
        return ",".join(sorted(registry.by_id[i].name for i in ids if i in registry.by_id))
    return names(running), names(waiting)


def stats_note(registry: LoRARegistry, running) -> str:
    """`, LoRA adapters: 3 loaded, running a,b` for the periodic stats line."""
    active = adapters_in_use(registry, running, ())[0]
    return (f", LoRA adapters: {len(registry.adapters)} loaded"
            + (f", running {active}" if active else ""))


def batch_lora_ids(seqs) -> list[int]:
    """Per scheduled sequence, its adapter's id; empty when none has one, so a step of
    base-model rows alone runs the base linears alone."""
    ids = [s.request.lora_id for s in seqs]
    return ids if any(ids) else []


def unload(core, name: str) -> None:
    """Stop serving an adapter (`EngineCore` `core`): new requests for it are 404s at
    once, and the model thread drops its tensors after the step in flight. Refused (409,
    `AdapterInUse`) while requests run or wait on it: they finish on the weights they
    started with, never cut short by an unload."""
    served = lora_id(core.loras, name)  # 404 unless served
    scheduler = core.scheduler
    live = sum(r.lora_id == served for r in (*scheduler.running, *scheduler.waiting))
    if live:
        raise AdapterInUse(f"the LoRA adapter {name} serves {live} request(s) now; unload it "
                           "when they have finished")
    gone = core.loras.remove(name).lora_id
    core.worker.call(lambda r: r.loras.remove(gone))
