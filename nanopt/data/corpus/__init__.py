"""Corpus sources: documents as strings, in a deterministic order, without holding the corpus (sources); read
through the `datasets` library (hf_datasets) or without it (plain_files); whether the hub can be reached (hub); whether
a local file is text at all (textcheck)."""
