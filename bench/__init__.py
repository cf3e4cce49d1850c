"""slimtune's benchmarks (not tests; outside the wheel): ``python -m bench NAME [flags]`` prints one JSON
line per measurement. NAME is ``save``, ``merge``, ``nf4``, ``load-moe``, ``dist-save``, ``train-step``,
``train-save`` or ``gguf`` (``bench/cli.py``); each lives in its own module here (``gguf`` in
``gguf/export.py``: a ``gguf.py`` would hide the gguf package from the scripts run as
``python bench/X.py``). The programs they time in a fresh process are modules too (``merge_child``,
``load_child``, ``gguf_child``; ``colab_child`` for ``gpu_check``), so that their peak RSS is the
job's own. The scripts beside them (``gpu_check``, ``real_model``, ``dist_curves``, ``packing``,
``merge_base_example``) and the peers (``peers/``) measure the rest.

Kept free of imports: every child program imports this package first."""
