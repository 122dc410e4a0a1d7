"""The serve config's application args (generated from the option dataclasses) and the capacity they imply."""
