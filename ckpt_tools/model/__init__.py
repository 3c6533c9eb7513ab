"""What a model is, apart from where it is stored: its shape (`spec.ModelSpec`), the layout table of how every tensor is
split over the ranks (`layout`, its vocabulary `rules`, the pipeline stages `stages`, the rank coordinates `ranks`, the
table applied to tensors `shard_ops`), the other names of its keys (`names`, `hf`, `conversions`, `hybrid`), HF's
quantized weights (`fp8`, `mxfp4`), and the declarative records of each model family (`families`) and feature
(`features`). Nothing here reads or writes a checkpoint's files."""
