"""Multi-LoRA serving: PEFT adapters loaded once (each module's scale computed and stored with its
weights), a slot table of resident adapters, and the batched apply of a step's adapters."""
