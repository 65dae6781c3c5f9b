# rules for the tokenizer stages
