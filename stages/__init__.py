"""One module per stage; each exposes STAGE. The order comes from their declared inputs (pipeline/core/catalogue.py)."""
