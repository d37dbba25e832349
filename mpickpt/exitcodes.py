"""Exit codes of an mpickpt job, shared by the run wrapper and the checkpointer.

========  =====================================================================
code      meaning
========  =====================================================================
0         finished
1         failed: an uncaught exception on some rank (the job was aborted)
2         usage: a bad ``python -m mpickpt.run`` command line, or the script does not exist
3         preempted: a checkpoint of the current step was committed (or the time left was too
          short and the last committed one stands); under Slurm the job was requeued
75        a collective of the checkpoint protocol missed its deadline (a rank died or hangs);
          the job was aborted, the last committed checkpoint is loadable
130       interrupted: KeyboardInterrupt on some rank (the job was aborted)
========  =====================================================================
"""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PREEMPTED = 3
EXIT_COLLECTIVE_TIMEOUT = 75
EXIT_INTERRUPTED = 130
