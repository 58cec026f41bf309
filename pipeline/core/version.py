"""The pipeline's own version (recorded in every manifest and bundle)."""
__version__ = "0.1.0"
