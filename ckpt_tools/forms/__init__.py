"""The on-disk forms, their readers and writers: every form read is a record of `readers` (how it is told apart, its
reader, its torch-free byte index) and every Megatron-LM form written a record of `forms` (what it holds, its writer);
our checkpoint directory (`checkpoint`, `target`), the reader seam every verb reads through (`shards.Reader`),
Megatron-LM's save dirs in each of their forms and their arguments both ways (`megatron_lm`, `megatron_spec`,
`megatron_args`), HF safetensors dirs (`hf_tensors`), torch.save archives read and written without torch
(`torchfile`, `torchsave`) and the streaming writers. A reader or writer does not know which verb called it."""
