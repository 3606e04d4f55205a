"""The turn judge of paper Table 9 / appendix B.5: an LLM scores each answer on the six 0-5 rubric
dimensions and four hard-failure flags under a JSON schema; deterministic signals back it up."""
