"""Lightning strategies (``Trainer(strategy="qmuon_fsdp")``). Empty until the FSDP2 strategy lands;
nothing is registered yet."""
