"""Sensitivity probes of the QTM controller (paper section 5.4, appendix E.5-E.6)."""
