"""The chaos soak (``./dev chaos --minutes N``): the cluster in a box (bench/cluster.py) under
overlapping faults, checked from the disks (issue 28). See bench/chaos/soak.py."""
