"""Prewarm: the recorder's spool, manifests, the replay worker and bundles.

Light on purpose: the CLI's help reads MAX_BUNDLE_BYTES without importing the bundle code."""

MAX_BUNDLE_BYTES = 4 << 30  # of a whole bundle file: a bigger one is refused before it is read (it is held in memory)
