"""Dataset preparation: the papers' training and evaluation sets as prompt/answer JSONL
(`megapkl data prepare`); `registry.SOURCES` is the table of sources and eval protocols."""
