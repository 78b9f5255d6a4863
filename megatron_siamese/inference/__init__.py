"""After pretraining: a checkpoint's model without a training loop (``session.py``), and text
generation through Megatron's inference engine (``generate.py``)."""
