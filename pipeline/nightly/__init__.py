"""Nightly regression: compare a run with its baseline (`regression`), latency measured A/B (`ab_latency`), run
history in SQLite (`history`), the HTML report (`report`), and the conformance zoo (`conformance`).
"""
