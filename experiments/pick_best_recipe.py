import json, sys
r = json.load(open(sys.argv[1]))
best = {}
for x in r["results"]:
    if x["max_value"] == 200 and x["accuracy"] > best.get(x["family"], {}).get("accuracy", -1):
        best[x["family"]] = x
slot = {"qwen2": "qwen25", "llama": "llama32", "qwen3": "qwen3"}
print(" ".join(f"--config.agents.{slot[f]}.model_path={x['directory']}" for f, x in best.items()))
