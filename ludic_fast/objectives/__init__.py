"""What the engine (`ludic_fast.engine`) optimises, one module each: `rl` (RL and SFT on SAW items from a batch
source), `preference` (DPO family, KTO), `reward` (Bradley-Terry value head), `distill` (off- and on-policy);
`examples` is the shuffled example stream the offline objectives draw their steps from."""
