"""After pretraining: a checkpoint's model without the trainer (``session.py``), and text
generation through Megatron's inference engine (``generate.py``)."""
