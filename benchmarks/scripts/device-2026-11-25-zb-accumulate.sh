# one device call: the last pp=2 GPT-3 1.3B stage after the weight graphs accumulate into .grad
# and held outputs move to copies. Memory (each variant in its own process; the five commands side
# by side), then uncontended alternating rounds at seq 512 for speed.
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0])"; } > $R/env.txt
S="python tools/stage_memory.py --stages 1 --steps 8 --steady-from 3 --timeout 200"
timeout 330 $S --order zb --variants eager,default,no_accumulate --seq-len 2048 --out $R/zb-s1-seq2048.json > $R/zb-s1-seq2048.txt 2>&1 &
timeout 330 $S --order zb --keep-outputs --variants eager,default,graphed_loss --seq-len 2048 --out $R/zb-keep-s1-seq2048.json > $R/zb-keep-s1-seq2048.txt 2>&1 &
timeout 330 $S --order zb --keep-outputs --variants eager,default,graphed_loss --seq-len 512 --out $R/zb-keep-s1-seq512.json > $R/zb-keep-s1-seq512.txt 2>&1 &
timeout 330 $S --keep-outputs --variants eager,default,graphed_loss --seq-len 2048 --out $R/1f1b-keep-s1-seq2048.json > $R/1f1b-keep-s1-seq2048.txt 2>&1 &
timeout 330 $S --keep-outputs --variants eager,default,graphed_loss --seq-len 512 --out $R/1f1b-keep-s1-seq512.json > $R/1f1b-keep-s1-seq512.txt 2>&1 &
wait
for f in $R/zb-s1-seq2048 $R/zb-keep-s1-seq2048 $R/zb-keep-s1-seq512 $R/1f1b-keep-s1-seq2048 $R/1f1b-keep-s1-seq512; do
  echo "== $(basename $f)"; grep -h "^stage\|ERROR\|Error" $f.txt | cut -c1-220; done
echo "== uncontended, seq 512"
timeout 200 python tools/stage_memory.py --stages 1 --order zb --keep-outputs --variants eager,default,eager,default --seq-len 512 --steps 12 --steady-from 4 --timeout 60 --out $R/time-zb-keep-s1-seq512.json > $R/time-zb.txt 2>&1
grep "^stage\|ERROR" $R/time-zb.txt
timeout 150 python tools/stage_memory.py --stages 1 --variants default,graphed_loss,default,graphed_loss --keep-outputs --seq-len 512 --steps 12 --steady-from 4 --timeout 40 --out $R/time-1f1b-keep-s1-seq512.json > $R/time-1f1b.txt 2>&1
grep "^stage\|ERROR" $R/time-1f1b.txt
cat $R/env.txt
tar czf $OUT/run.tgz -C $R .
