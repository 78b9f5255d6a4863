"""The data the package brings: the embedded corpus and the addition task, in Megatron's indexed format."""
