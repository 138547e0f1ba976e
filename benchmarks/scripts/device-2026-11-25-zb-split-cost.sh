# one device call: what splitting the backward costs on one GPU (tools/bench_zero_bubble.py --single-gpu:
# 6 GPT-3 1.3B blocks, bf16, 4 micro-batches), the code before this session's zero-bubble changes
# (d788551, carried as .gl/oldtree) and after, alternately: old, new, old, new
# .gl/oldtree: mkdir -p .gl/oldtree && git archive d788551 paddle_graphpp tools | tar x -C .gl/oldtree (run with carry [".gl/oldtree"])
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0])"; } > $R/env.txt
for i in 1 2; do
  (cd .gl/oldtree && PYTHONPATH=$PWD timeout 240 python tools/bench_zero_bubble.py --single-gpu --name old-$i > $R/old-$i.txt 2>&1)
  PYTHONPATH=$PWD timeout 240 python tools/bench_zero_bubble.py --single-gpu --name new-$i > $R/new-$i.txt 2>&1
done
for f in old-1 new-1 old-2 new-2; do echo "== $f"; python -c "
import json,glob
d=json.load(open(glob.glob('$OUT/$f-split-*.json')[0]))['results']
for s,e in d.items(): print(s, {k: round(v['median_ms'],1) for k,v in e['timings_ms'].items()}, 'split/full graphed', round(e['split_over_full_graphed'],3))
" 2>&1 | tail -3; done
cat $R/env.txt
tar czf $OUT/run.tgz -C $R .
