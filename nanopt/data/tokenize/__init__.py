"""The tokenize pipeline (`nanopt tokenize`): a corpus source in, a dataset directory out (pipeline); its settings
(settings), documents split and cut into pieces (documents), --sample and --shuffle-buffer (sampling, shuffle), the
per-split statistics and the summary said at the end (stats, summary), the C heap kept from creeping (heap)."""
