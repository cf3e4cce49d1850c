"""GGUF, llama.cpp's file format, in one package: what llama.cpp expects of each family (``arch``), the
tokenizer's metadata and the Ollama Modelfile (``vocab``, ``pretokenizers``), the K-quant mixes (``mix``),
ggml's block quantizers (``ggml``, ``kquants`` on the worker processes of ``pool``), and the two exports
over the merged tensor stream: the model (``export``) and the LoRA adapter (``adapter``), whose file head
(header, metadata, tensor infos) ``header`` writes. The type names, once, sit below the package
(``slimtune.formats.gguf_types``), so the config reads them without it."""
