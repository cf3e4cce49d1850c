"""What the vision GGUF tests share: the f16 export of a checkpoint's pair, its tensors, and llama.cpp's
multimodal library (llama-cpp-python's mtmd) driven on an image."""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest

from slimtune.cli import main as slimtune_main
from tests.conftest import llama_cpp_oracle

llama_cpp = llama_cpp_oracle()
mtmd = pytest.importorskip("llama_cpp.mtmd_cpp")


def _mtmd_chunks(ctx, prompt: bytes, image: np.ndarray):
    """mtmd's chunks of ``prompt`` (with its media marker) and the image: [(type, text tokens or image token count, chunk)]."""
    bitmap = mtmd.mtmd_bitmap_init(image.shape[1], image.shape[0], (ctypes.c_uint8 * image.size).from_buffer_copy(image.tobytes()))
    text = mtmd.mtmd_input_text()
    text.text, text.text_len, text.add_special, text.parse_special = prompt, len(prompt), False, True
    chunks = mtmd.mtmd_input_chunks_init()
    assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
    out = []
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        kind, n = mtmd.mtmd_input_chunk_get_type(chunk), mtmd.mtmd_input_chunk_get_n_tokens(chunk)
        if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            count = ctypes.c_size_t()
            ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
            out.append((kind, [ids[j] for j in range(count.value)], chunk))
        else:
            out.append((kind, n, chunk))
    return chunks, bitmap, out


def export_f16_pair(root, ckpt) -> dict:
    """``slimtune export`` of ``ckpt`` to f16 under ``root/export``: the model GGUF and the mmproj beside it."""
    out = root / "export" / "model-f16.gguf"
    out.parent.mkdir()
    assert slimtune_main(["export", str(ckpt), "--type", "f16", "--out", str(out)]) == 0
    return dict(root=root, ckpt=ckpt, model=out, mmproj=out.with_name("model-mmproj-f16.gguf"))


def read_tensors(path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def mtmd_answer(model_path, mmproj_path, prompt: bytes, image: np.ndarray, width: int = 128, mrope: bool = False):
    """mtmd (llama.cpp's multimodal library) on the pair: the prompt's chunks ([(type, text tokens or image
    token count)]), each image chunk's embeddings ([tokens, width]), the logits at the last position after
    every chunk is evaluated, and the positions used; ``mrope``: the pair must decode with M-RoPE."""
    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=128, n_batch=128, logits_all=True, verbose=False)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings, params.warmup = False, 1, False, False
    ctx = mtmd.mtmd_init_from_file(str(mmproj_path).encode(), llm.model, params)
    assert ctx and mtmd.mtmd_support_vision(ctx) and (not mrope or mtmd.mtmd_decode_use_mrope(ctx))
    try:
        chunks, bitmap, parts = _mtmd_chunks(ctx, prompt, image)
        embeddings = []
        for kind, n, chunk in parts:
            if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                assert mtmd.mtmd_encode_chunk(ctx, chunk) == 0
                embeddings.append(np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n * width,)).reshape(n, width).copy())
        n_past = llama_cpp.llama_pos(0)
        assert mtmd.mtmd_helper_eval_chunks(ctx, llm.ctx, chunks, 0, 0, 128, True, ctypes.byref(n_past)) == 0
        last = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
    finally:
        mtmd.mtmd_free(ctx)
        llm.close()
    return [(kind, x) for kind, x, _ in parts], embeddings, last, int(n_past.value)
