"""Pure domain logic of the paper (no transport imports): state rules, memory policy, features, LinUCB, packing, reward."""
