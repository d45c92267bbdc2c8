"""Benchmarks beside peers (compare, context, serve, dist, ...) and of our kernels (kernels, probes)."""


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB: Linux's VmHWM, the high-water mark of its own address space.
    (getrusage's ru_maxrss keeps the RSS of what ran before an exec: a worker spawned by a large process would
    report that process's size.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
