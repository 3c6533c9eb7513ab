"""For the scripts run under torchrun: every rank's report, gathered on rank 0 and written there as JSON."""
import json

import torch.distributed as dist


def write_reports(report: dict, out: str) -> None:
    """[each rank's `report`] -> `out` (rank 0 writes), then the process group is destroyed."""
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(reports, f, indent=1)
    dist.destroy_process_group()
