"""RL training data from raw general-domain text (issue #24; docs/data.md).

    from datagen.build import Build
    b = Build("out/", warehouse="warehouse_data")
    b.ingest("corpus/")                     # datasets_prep.corpus: pieces with ids and offsets
    b.synth(model_config, n=3)              # datagen.synth: checked LIS-RL questions
    b.clean(decontaminate=["math"])         # datasets_prep.dedup: exact, MinHash, 13-grams
    b.calibrate(policy_runner, samples=4)   # datagen.calibrate: pass-rate band
    b.export(runs=...)                      # datagen.export: verl rows, SFT JSONL, card

Synthesis and calibration need a model and runs, so they live here, above the
warehouse; the pure text stages (ingest, clean) live in datasets_prep. No Prefect here:
flows/data.py wraps each stage, sandflow/commands/data.py is the CLI.
"""
