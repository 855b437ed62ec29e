"""Shape and dtype rules, fake (meta) implementations and input validation, shared by every backend."""
