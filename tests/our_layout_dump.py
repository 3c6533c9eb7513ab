"""Run under torchrun (world 4): build the trainer's GPTStage at several TP x PP layouts and write
the ordered (key, shape, dtype) state-dict layout of every (tp_rank, pp_rank) to a JSON file.

    torchrun --nproc-per-node 4 tests/our_layout_dump.py CASES.json OUT.json
CASES.json: [{"name": ..., "spec": {ModelSpec fields}, "tp": N, "pp": M}, ...]
"""
import json
import sys
import warnings

import torch
import torch.distributed as dist
import trainer  # noqa: F401,I001 (megatron-core imported as the trainer imports it: no CPU torch.compile wrappers)
from megatron.core import parallel_state as ps

from ckpt_tools.model import layout
from ckpt_tools.model.spec import ModelSpec
from trainer.layers import megatron_config
from trainer.model import GPTStage


def main(cases_path: str, out_path: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {}
    for case in json.load(open(cases_path)):
        spec = ModelSpec.from_dict(case["spec"])
        tp, pp = case["tp"], case["pp"]
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        counts = layout.layers_per_stage(spec.num_layers, pp)
        mine = None
        if ps.get_data_parallel_rank() == 0:
            stage = GPTStage(spec, megatron_config(spec, tp, pp, torch.float32, on_cpu=True), tp_size=tp,
                             pp_rank=ps.get_pipeline_model_parallel_rank(), layer_counts=counts,
                             padded_vocab=spec.padded_vocab_size(tp))
            entries = [[k, list(v.shape) if torch.is_tensor(v) else None,
                        str(v.dtype).replace("torch.", "") if torch.is_tensor(v) else None]
                       for k, v in stage.state_dict().items()]
            mine = (f"{ps.get_tensor_model_parallel_rank()},{ps.get_pipeline_model_parallel_rank()}", entries)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        results[case["name"]] = dict(g for g in gathered if g is not None)
    if dist.get_rank() == 0:
        json.dump(results, open(out_path, "w"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
