"""Generative recommendation (MiniOneRec) as a plug-in: items are semantic IDs (SIDs) such as
<a_1><b_2><c_3>, and a model reads a user's history of SIDs and generates the next item's SID. The
package registers through the tables any third party uses (registry.DATA_FORMATS: `data_format:
minionerec`, format.py; registry.REWARDS: sid_hit and sid_rank, rewards.py); the core imports none
of it but vocab.py, whose extra_tokens reads a SID index (trie.py)."""
