"""Our GGUF header reader (`models/gguf_file.py`) against gguf-py's: the same metadata,
the same tensors at the same offsets with the same bytes; a file cut short is refused
by name; the tokenizer a conversion writes is transformers' own for the file."""

from __future__ import annotations

import numpy as np
import pytest

from models.gguf_file import GGUFFile
from models.resolve import default_gguf_path


def test_the_header_reads_as_gguf_py_reads_it():
    from gguf import GGUFReader

    path = default_gguf_path()
    ours, theirs = GGUFFile(path), GGUFReader(path)
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.metadata) == set(fields)
    for key, value in fields.items():
        if isinstance(value, float):
            assert np.float32(ours.metadata[key]) == np.float32(value), key
        else:
            assert ours.metadata[key] == value, key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.type_name, a.shape) == (b.name, b.tensor_type.name,
                                                  tuple(int(d) for d in b.shape))
        assert (a.offset, a.nbytes) == (b.data_offset, b.n_bytes)
    for a, b in ((ours.tensors[i], theirs.tensors[i]) for i in (0, 5, -1)):
        assert ours.read(a).tobytes() == np.asarray(b.data).tobytes()


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_a_file_cut_short_is_refused_by_name(tmp_path, keep):
    data = default_gguf_path().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(ValueError, match="cut.gguf"):
        GGUFFile(cut)


def test_not_a_gguf_is_refused(tmp_path):
    other = tmp_path / "x.gguf"
    other.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(other)


def test_the_tokenizer_is_transformers_own(tmp_path):
    """The conversion builds it with transformers' GGUF tokenizer builder directly (no
    parse of the whole file for a model config): the same tokenizer.json as
    `AutoTokenizer.from_pretrained(gguf_file=...)`."""
    from transformers import AutoTokenizer

    from models.gguf_convert import _gguf_tokenizer

    path = default_gguf_path()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    reference.save_pretrained(str(tmp_path / "a"))
    _gguf_tokenizer(path).save_pretrained(str(tmp_path / "b"))
    assert (tmp_path / "a" / "tokenizer.json").read_text() == \
        (tmp_path / "b" / "tokenizer.json").read_text()
