"""The QTM controller: schema, versioned prompts, backends and the guard that always yields a valid state."""
