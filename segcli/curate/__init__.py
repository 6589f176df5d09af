"""Curation: statistics that stream and combine exactly, per-element reference energies
(`statistics`), and the choice of structures by conditions, lists and shards (`selection`)."""
