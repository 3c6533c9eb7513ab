"""The commands' work: one module per verb (`merge`, `reshard`, `importer`, `verify`, `inspect`, `to_megatron`), their
torch-free byte copies (`dist_copy`, `hf_copy`, `ours_copy`) and what they share (`plan`, `request`, `tiers`);
`paths` chooses which path, the byte copy or torch, writes a reshard's or an import's output. `cli.py` parses the
command line and calls into here."""
