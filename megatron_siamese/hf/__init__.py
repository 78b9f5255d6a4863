"""Hugging Face Transformers: export a checkpoint (``export.py``) and import one back
(``import_hf.py``); the architecture and config.json (``architecture.py``), the weight names
(``convert.py``), the byte-level tokenizer's files (``tokenizer.py``) and the self-contained
modeling file shipped with every export (``modeling_siamese.py``). transformers and safetensors
are imported only here, when a command runs (docs/export.md)."""
