"""Hugging Face formats: model dirs read and written, Trainer ``checkpoint-N`` dirs."""
