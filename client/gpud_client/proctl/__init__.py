"""Process control: pausing, parking, resuming and ending a process tree, with backends behind one
interface (``base.Backend``).

- ``tree``: a process tree as /proc shows it (the descendants of one root);
- ``signals``: the ``signal`` backend, SIGSTOP and SIGCONT, for any program anywhere, watched for
  escapes (a process continued from outside is stopped again and told);
- ``cgroup``: the program's cgroup v2, frozen and thawed by whoever holds it (a ``Freezer``: for
  ``gpuctl run``, gpud), alone or beside the ``cuda`` backend;
- ``cuda``: the CUDA driver's checkpoint API (lock, unlock, checkpoint, restore), through one
  long-lived helper process (``cuda_helper``) with a deadline on every call; needs the
  ``gpud-client[cuda]`` extra and a driver of CUDA 12.8 or later;
- ``keeper``: the parent of a run's program, which ends the whole tree when the run goes.

It decides nothing: ``gpud_client.run`` (and the rules in ``gpud_client.core.run``) say when.
It knows nothing of gpud either, so a node agent that pauses processes it did not start can use
it as it is.
"""
