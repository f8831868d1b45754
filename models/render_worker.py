"""A chat-template renderer in its own process, which the server can kill.

A template is code a render runs to its end: a Python thread cannot be stopped inside
it, so a template that loops for hours, or builds a gigabyte string, would hold its
thread (or the event loop) for as long as it likes. The server (`app/engine/renderer.py`)
keeps a few of these processes and kills one whose render runs past its time bound or
whose client left; the process bounds its own memory (RLIMIT_AS) and its output
(`max_output_chars`), and reports either as an error of the render.

Run as `python -m models.render_worker MEMORY_BYTES`. It imports jinja2 and
`models/chat_template.py` only (no torch, nothing of the server), so it starts in
about a tenth of a second. The protocol on stdin/stdout is frames of a 4-byte
big-endian length and that many bytes of JSON:

- once started, the worker sends `{"ready": true}`;
- each request is a job, `{"template", "messages", "tools", "documents",
  "add_generation_prompt", "continue_final_message", "variables", "max_output_chars"}`;
- each answer is `{"text": ...}` or `{"error": message, "kind": kind}`, where kind is
  `template` (the template refused the input or is not valid Jinja), `too_long` or
  `memory`.

End of input (the server closed the pipe, or died) ends the worker.
"""

from __future__ import annotations

import json
import resource
import signal
import struct
import sys
from typing import Any, BinaryIO

from models.chat_template import OutputTooLong, render_chat

FRAME_HEADER = struct.Struct(">I")


def encode_frame(message: Any) -> bytes:
    """One frame; ASCII JSON, so that a lone surrogate in a message survives the trip."""
    data = json.dumps(message).encode()
    return FRAME_HEADER.pack(len(data)) + data


def read_frame(stream: BinaryIO) -> Any | None:
    """The next frame's message, or None at end of input."""
    header = stream.read(FRAME_HEADER.size)
    if len(header) < FRAME_HEADER.size:
        return None
    (size,) = FRAME_HEADER.unpack(header)
    data = stream.read(size)
    return None if len(data) < size else json.loads(data)


def render_job(job: dict[str, Any]) -> dict[str, Any]:
    """One job's answer; every failure of the render is the job's, not the worker's."""
    try:
        text = render_chat(job["template"], job["messages"], tools=job.get("tools"),
                           documents=job.get("documents"),
                           add_generation_prompt=job.get("add_generation_prompt", False),
                           continue_final_message=job.get("continue_final_message", False),
                           max_output_chars=job.get("max_output_chars"),
                           **job.get("variables", {}))
    except MemoryError:
        return {"error": "the chat template ran out of memory", "kind": "memory"}
    except OutputTooLong as e:
        return {"error": str(e), "kind": "too_long"}
    except RecursionError:
        return {"error": "the chat template recursed too deeply", "kind": "template"}
    except Exception as e:  # the template's own checks, syntax errors, bad arguments
        return {"error": str(e) or type(e).__name__, "kind": "template"}
    return {"text": text}


def main(argv: list[str]) -> int:
    # The server decides when a worker ends: a Ctrl-C in the terminal reaches the whole
    # process group, and would otherwise print a traceback from every worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    memory = int(argv[1]) if len(argv) > 1 else 0
    if memory > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(encode_frame({"ready": True}))
    stdout.flush()
    while (job := read_frame(stdin)) is not None:
        try:
            answer = encode_frame(render_job(job))
        except MemoryError:  # the text was made but not its frame
            answer = encode_frame({"error": "the chat template ran out of memory",
                                   "kind": "memory"})
        stdout.write(answer)
        stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
