"""One grammar-compiling process: specs in on stdin, serialized compiled grammars out.

The server compiles grammars here, not in its own process, because a compile cannot be
interrupted from inside: xgrammar runs it in C++ to the end, however long (minutes for
a large enum) and however much memory it takes. A process can be killed. The parent
(`app/engine/grammar_pool.py`) starts a few of these with
`sys.executable -m app.engine.grammar_worker`, kills one whose compile runs past its
time bound or whose every waiting client has left, and starts another.

This module imports nothing from the server (`app/__init__` is light) and only
xgrammar for the work (which itself loads torch and transformers, so a worker takes a
few seconds to start). The compiler is built once from the parent's serialized
`TokenizerInfo`, so both sides agree on the vocabulary.

The protocol is framed on the pipes: a JSON header line carrying `n`, then `n` bytes
of payload. Parent → worker: first `{"threads", "memory_bytes"}` + the tokenizer info,
then `{"kind"}` + the spec. Worker → parent: `{"ready": true}` once, then per spec
`{"ok": true}` + the compiled grammar's JSON, or `{"error", "costly"}`: `costly` says
the bound was hit (memory, result size) rather than the spec being wrong. The address
space is limited (RLIMIT_AS) to what the worker had when ready plus `memory_bytes`.
"""

from __future__ import annotations

import json
import os
import sys

# A compiled grammar's JSON grows with nesting faster than its memory does (a schema
# of arrays nested 64 deep: 0.2 MB in memory, 3.5 MB as JSON); past this it is refused.
MAX_RESULT_BYTES = 32 << 20


def write_frame(stream, header: dict, payload: bytes = b"") -> None:
    stream.write(json.dumps({**header, "n": len(payload)}).encode() + b"\n" + payload)
    stream.flush()


def read_frame(stream) -> tuple[dict, bytes] | None:
    line = stream.readline()
    if not line:
        return None
    header = json.loads(line)
    payload = stream.read(header["n"]) if header["n"] else b""
    return header, payload


def _limit_memory(extra: int) -> None:
    """Cap the address space at what the worker maps now plus `extra` bytes."""
    import resource

    try:
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        return  # not Linux: no bound beyond the parent's time bound
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra, vm + extra))


def _die_with_parent() -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def compile_spec(compiler, kind: str, spec: str):
    if kind == "json":
        return compiler.compile_json_schema(spec, any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                            strict_mode=False)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        return compiler.compile_grammar("root ::= " + " | ".join(map(json.dumps,
                                                                      json.loads(spec))))
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(spec)
    raise ValueError(f"unknown structured output kind {kind!r}")


def main() -> None:
    _die_with_parent()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything a library prints goes to stderr, not into the protocol
    inp = sys.stdin.buffer
    first = read_frame(inp)
    if first is None:
        return
    hello, info_json = first
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(info_json.decode())
    compiler = xgr.GrammarCompiler(info, max_threads=hello["threads"], cache_enabled=False)
    _limit_memory(hello["memory_bytes"])
    write_frame(out, {"ready": True})
    while (frame := read_frame(inp)) is not None:
        header, spec = frame
        try:
            text = compile_spec(compiler, header["kind"], spec.decode()).serialize_json()
            data = text.encode()
            del text
        except MemoryError:
            write_frame(out, {"error": "it needs more memory than the compile bound",
                              "costly": True})
            return  # a failed allocation may have left the process in a bad state
        except Exception as e:  # noqa: BLE001 - every error goes back to the request
            if "bad_alloc" in str(e):
                write_frame(out, {"error": "it needs more memory than the compile bound",
                                  "costly": True})
                return
            write_frame(out, {"error": str(e), "type": type(e).__name__})
            continue
        if len(data) > MAX_RESULT_BYTES:
            write_frame(out, {"error": f"its compiled form is {len(data) >> 20} MiB, more "
                                       f"than {MAX_RESULT_BYTES >> 20} MiB", "costly": True})
        else:
            write_frame(out, {"ok": True}, data)


if __name__ == "__main__":
    main()
