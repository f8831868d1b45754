"""Shared test set-up.

Triton kernels run under the interpreter when there is no GPU (CI, this
machine). The variable must be set before triton is first imported.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    """A crash in native code dumps every thread's stack to the terminal: pytest's own
    fault handler writes to stderr as its capture has redirected it, a file the crash
    takes with it, so CI's log would show only "Segmentation fault"."""
    import faulthandler

    capture = getattr(config.pluginmanager.getplugin("capturemanager"), "_global_capturing",
                      None)
    saved = getattr(getattr(capture, "err", None), "targetfd_save", None)
    if isinstance(saved, int):
        faulthandler.enable(file=os.fdopen(os.dup(saved), "w"), all_threads=True)


# --- The real SmolLM2-135M-Instruct, shared by every test that needs it -------------
# Imports stay inside the fixtures: transformers is slow to import, and tests that never
# touch the real model should not pay for it.


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """The embedded default model as a complete HF directory: its conversion (once, then
    cached), exported with every weight dense as well as its blocks, so transformers
    loads it as the parity reference and tests read its dense tensors."""
    from models.resolve import export_model

    return export_model(None, tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def hf_gguf_model():
    """transformers' own GGUF loading of the same file: the independent reference (~15 s)."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    from transformers import AutoModelForCausalLM

    from models.resolve import default_gguf_path

    gguf = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path):
    from models.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, smollm2_dir):
    """A tiny random-weight Llama with the real SmolLM2 tokenizer (models/tiny.py)."""
    from models.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), smollm2_dir)
