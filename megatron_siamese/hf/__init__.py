"""Hugging Face Transformers: export a checkpoint and import one back (``export.py``); the
architecture and config.json (``architecture.py``), the weight names (``convert.py``), the
byte-level tokenizer's files (``tokenizer.py``) and the self-contained modeling file shipped with
every export (``modeling_siamese.py``). transformers and safetensors are imported only here, when
a command runs (docs/export.md)."""
