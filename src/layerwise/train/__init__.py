"""Training runs end to end: data (corpus, tokenizer, packing), the LR schedule, the training
loop that drives the engine and checkpoints, and the ``demo`` / ``train`` commands."""
