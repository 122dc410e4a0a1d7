"""The LoRA adapters a replica serves: configured, loaded at run time or found on first use, and held."""
