"""The pure session core: values, the fold, policy, compaction and progress. No I/O, no clock."""
