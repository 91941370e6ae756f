"""Signed provenance: in-toto statements about how a task's DIFF.patch was made and who decided
on it, in DSSE envelopes signed with ed25519 keys (docs/provenance.md)."""
