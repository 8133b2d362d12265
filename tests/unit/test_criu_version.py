"""CRIU version facts: which CRIU can dump what on which kernel."""



def test_inet_sockets_problem_only_for_old_criu_on_new_kernels():
    from gpusnap.criu.version import inet_sockets_problem

    why = inet_sockets_problem("4.1.1", "6.18.44-fc-v669")
    assert why and "CRIU 4.1.1" in why and "Linux 6.18.44" in why
    assert inet_sockets_problem("4.1.1", "6.16.0") is not None
    assert inet_sockets_problem("4.1.1", "6.15.9-1-amd64") is None
    assert inet_sockets_problem("4.2.1", "6.18.44") is None
    assert inet_sockets_problem("4.2", "7.0.1") is None
    assert inet_sockets_problem(None, "6.18") is None
