"""`paratrain doctor`: the classic mistakes of a training script, found by reading it.

The script is parsed with ``ast`` and never run. Each rule (``doctor.rules``, one module per
family) reports file, line, what is wrong and the fix; the script's style (plain loop,
DataParallel, DDP, Accelerate, Fabric, Horovod, paratrain) names the page of docs/ that ports it.
Rules prefer silence to a guess: a finding must be there.
"""

from paratrain.tools.doctor.diagnose import diagnose, diagnose_source
from paratrain.tools.doctor.findings import Diagnosis, Finding, Style
from paratrain.tools.doctor.rules import RULES, Rule

__all__ = ["RULES", "Diagnosis", "Finding", "Rule", "Style", "diagnose", "diagnose_source"]
