"""Mixture search (docs/search.md): a swarm of small proxy runs on sampled mixtures, a fitted model of their
held-out metrics as a function of the weights, and a proposed mixture under every source's epoch cap.

    tokenmill mixture swarm BASE.yaml --run-config PROXY.yaml --proxies 32 --output SWARM   # sample, write
    tokenmill mixture run SWARM --workers 2                                                # train (resumable)
    tokenmill mixture fit SWARM                                                            # fit.json
    tokenmill mixture propose SWARM --output proposed.yaml                                 # the new mixture
    tokenmill mixture validate SWARM --compute 4 --seeds 3                                 # check it

The layer above the trainer: it writes mixtures and run configurations and starts `tokenmill train` in
worker processes; what it records is typed in tokenmill.formats.swarm, which the report reads.
"""
