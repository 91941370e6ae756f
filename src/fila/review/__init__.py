"""What a person reads and decides: the review report, DIFF.patch parsed, apply and its
landing, decisions, and groups of tasks compared."""
